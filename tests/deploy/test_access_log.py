"""gunicorn's access line, as ``app/gunicorn_conf.py`` makes it .

``PoimenLogger`` formats the line from ``LazyAtoms``, which makes only the atoms the
format names; gunicorn's own ``Logger.atoms`` + ``SafeAtoms`` make all of them. The two
must agree on every atom and on the line. Checked in a child process: loading
``app/gunicorn_conf.py`` sets up logging and a metrics directory, which this process must
not inherit. (The request and response are plain objects with the attributes gunicorn's
logger reads; the real line, from a real gunicorn, is checked in
``tests/app/test_request_ids.py``.)
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.processes import ROOT

CHILD = r'''
import datetime, json, runpy, types
from gunicorn.config import Config
from gunicorn.glogging import SafeAtoms

conf = runpy.run_path("app/gunicorn_conf.py")
cfg = Config()
cfg.set("accesslog", "-")
cfg.set("access_log_format", conf["access_log_format"])
logger = conf["PoimenLogger"](cfg)
environ = {"REMOTE_ADDR": "10.0.0.7", "REQUEST_METHOD": "POST", "RAW_URI": "/v1/runs?x=1",
           "SERVER_PROTOCOL": "HTTP/1.1", "PATH_INFO": "/v1/runs", "QUERY_STRING": "x=1",
           "HTTP_USER_AGENT": 'agent "quoted"', "HTTP_AUTHORIZATION": "Basic dXNlcjpwdw==",
           "poimen.tenant": "acme", "poimen.run_id": "r-1", "Mixed.Case": "m"}
req = types.SimpleNamespace(headers=[("USER-AGENT", "ua"), ("X-REQUEST-ID", "first"),
                                     ("X-REQUEST-ID", "second")])
resp = types.SimpleNamespace(status="201 CREATED", sent=531,
                             headers=[("Content-Type", "application/json"),
                                      ("X-Request-ID", 'r"1')])
rt = datetime.timedelta(seconds=1, microseconds=234567)
keys = list("hlutrsmUqHbBfaTDMLp") + [
    "{x-request-id}o", "{X-Request-ID}o", "{x-request-id}i", "{user-agent}i",
    "{poimen.tenant}e", "{POIMEN.RUN_ID}e", "{mixed.case}e", "{absent}i", "{absent}e",
    "{content-type}O", "{x}z", "zz"]
lazy = conf["LazyAtoms"](logger, resp, req, environ, rt)
safe = SafeAtoms(logger.atoms(resp, req, environ, rt))
print(json.dumps({
    "atoms": [[k, repr(lazy[k]), repr(safe[k])] for k in keys if k != "t"],
    "line": [cfg.access_log_format % lazy, cfg.access_log_format % safe],
    "len": len(lazy)}))
'''


@pytest.mark.processes  # a child Python, so app/gunicorn_conf.py sets up nothing here
def test_the_lean_atoms_are_gunicorns_atoms():
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    differ = [(k, lazy, safe) for k, lazy, safe in result["atoms"] if lazy != safe]
    assert not differ
    lazy_line, safe_line = result["line"]
    # %(t)s is the clock: the two lines were made within the same second or one apart.
    assert lazy_line.split("[", 1)[0] == safe_line.split("[", 1)[0]
    assert lazy_line.split("]", 1)[1] == safe_line.split("]", 1)[1]
    assert 'request_id=r\\"1 tenant=acme run_id=r-1' in lazy_line
    assert result["len"] > 0  # a record takes a non-empty mapping as its arguments
