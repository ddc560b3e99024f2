"""The console in a real browser: gunicorn, a Celery worker, and headless Chromium.

Debian's ``chromium`` and ``chromium-driver`` drive the pages through Selenium
(``make test`` installs them when it runs as root). Without them these tests
skip, and say why in the summary (``-ra``).
"""

from __future__ import annotations

import secrets
import shutil
import warnings

import pytest
import requests

from tests.processes import start_web, start_worker, wait_until

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
NO_BROWSER = ("no browser for the console tests: install Debian's chromium and chromium-driver "
              "(make test does it when run as root)")

# Seconds: the machine is shared and loaded; these are deadlines on conditions.
RUN_DEADLINE = 180


@pytest.fixture(autouse=True)
def clean_tables():
    """No TRUNCATE here: each test has tenants of its own, and emptying
    ``worker_boots`` would pull the boot row from under this module's live worker."""
    yield


SCHEDULE_TENANT = "console-sched"


@pytest.fixture(scope="module")
def console_env(test_env) -> dict[str, str]:
    # A 1 s token cache, so a revocation ends a session within the test's patience.
    # The schedules page lists tests/workflows/reuse.py's scheduled workflow for SCHEDULE_TENANT.
    return {**test_env, "POIMEN_CONSOLE_SECRET": secrets.token_urlsafe(48),
            "POIMEN_TOKEN_CACHE_SECONDS": "1",
            "POIMEN_WORKFLOW_MODULES":
                "tests.workflows,tests.workflows.reuse,tests.workflows.backlog",
            "POIMEN_TEST_SCHEDULE_TENANT": SCHEDULE_TENANT}


@pytest.fixture(scope="module")
def console_url(console_env, tmp_path_factory) -> str:
    """The ``web`` process as the Procfile runs it: gunicorn, two workers (a session
    signed by one must be accepted by the other)."""
    proc, url = start_web(console_env, tmp_path_factory.mktemp("console-web"), workers=2,
                          threads=4, name="console-web")
    yield url
    proc.teardown()


@pytest.fixture(scope="module")
def worker(test_env, tmp_path_factory):
    proc = start_worker(test_env, tmp_path_factory.mktemp("console-worker"), name="console-worker",
                        concurrency=2)
    yield proc
    proc.teardown()


@pytest.fixture(scope="module")
def browser(console_url):
    """Headless Chromium that can resolve no host but the app's (127.0.0.1).

    ``--host-resolver-rules`` makes every other name unresolvable, so a page that
    needed anything from outside would visibly break; the performance log
    records every request the pages make (test 5 reads it).
    """
    if not (CHROMIUM and CHROMEDRIVER):
        warnings.warn(NO_BROWSER, stacklevel=2)
        pytest.skip(NO_BROWSER)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,1700", "--no-first-run", "--disable-sync",
                "--disable-background-networking", "--disable-component-update",
                "--disable-default-apps", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


class Console:
    """The console as a person uses it (the browser), plus a plain HTTP client for status codes."""

    def __init__(self, url: str, driver):
        self.url = url
        self.driver = driver

    def open(self, path: str) -> None:
        self.driver.get(self.url + path)

    def sign_in(self, token: str) -> None:
        from selenium.webdriver.common.by import By

        self.driver.delete_all_cookies()
        self.open("/console/sign-in")
        self.driver.find_element(By.ID, "token").send_keys(token)
        self.driver.find_element(By.ID, "sign-in").click()
        wait_until(lambda: "/console/runs" in self.driver.current_url, timeout=30,
                   what="the runs list after sign-in")

    def http(self) -> requests.Session:
        """A requests session carrying the browser's console cookie."""
        session = requests.Session()
        for cookie in self.driver.get_cookies():
            session.cookies.set(cookie["name"], cookie["value"], path=cookie.get("path", "/"))
        return session

    def csrf(self) -> str:
        from selenium.webdriver.common.by import By

        return self.driver.find_element(By.NAME, "csrf_token").get_attribute("value")

    def texts(self, css: str) -> list[str]:
        from selenium.webdriver.common.by import By

        return [e.text for e in self.driver.find_elements(By.CSS_SELECTOR, css)]

    def attrs(self, css: str, name: str) -> list[str]:
        from selenium.webdriver.common.by import By

        return [e.get_attribute(name) for e in self.driver.find_elements(By.CSS_SELECTOR, css)]


@pytest.fixture
def console(console_url, browser) -> Console:
    return Console(console_url, browser)


@pytest.fixture
def api(console_url):
    """Call the /v1 API of the console's web process as ``creds``."""

    def call(method: str, path: str, creds, **kwargs) -> requests.Response:
        return requests.request(method, console_url + path, headers=creds.headers, timeout=30,
                                **kwargs)

    return call


@pytest.fixture
def run_until(api):
    """Wait (with a deadline) until a run's status is one of ``statuses``; return its body."""

    def wait(creds, run_id, *statuses: str, timeout: float = RUN_DEADLINE) -> dict:
        def check():
            body = api("GET", f"/v1/runs/{run_id}", creds).json()
            return body if body["status"] in statuses else None

        return wait_until(check, timeout=timeout, interval=0.3,
                          what=f"run {run_id} to be {'/'.join(statuses)}")

    return wait
