"""``GET /v1/runs``: what a page holds, not only that it answers 200.

docs/guide/api.md ("In short"): newest first; follow ``next_cursor``; filters ``status`` (comma
separated), ``goal_id``, ``workflow_ref``, ``dispatch_key``, ``parent_run_id``
(the last is witnessed by the fan-out tests in tests/workers/test_step_entry_dispatch.py).
Runs are committed one request at a time so their ``created_at`` differ.
"""

from __future__ import annotations

import pytest


def _admit(client, creds, **body) -> str:
    created = client.post("/v1/runs", json={"input": {}, **body}, headers=creds.headers)
    assert created.status_code == 201, created.json
    return created.json["id"]


def _ids(client, creds, query: str = "") -> list[str]:
    response = client.get(f"/v1/runs?{query}", headers=creds.headers)
    assert response.status_code == 200, response.json
    return [run["id"] for run in response.json["runs"]]


def _all_pages(client, creds, query: str, limit: int) -> list[list[str]]:
    pages, cursor = [], None
    while True:
        page_query = f"{query}&limit={limit}" + (f"&cursor={cursor}" if cursor else "")
        body = client.get(f"/v1/runs?{page_query}", headers=creds.headers).json
        pages.append([run["id"] for run in body["runs"]])
        cursor = body["next_cursor"]
        if cursor is None:
            return pages
        assert len(pages) < 10, "the cursor does not advance"


@pytest.fixture
def listed(client, make_tenant):
    """Five runs of one tenant, oldest first, one cancelled; one run of another tenant."""
    owner, other = make_tenant(), make_tenant()
    runs = [
        _admit(client, owner, workflow_ref="echo", goal_id="g1", dispatch_key="k0"),
        _admit(client, owner, workflow_ref="versioned", goal_id="g1"),
        _admit(client, owner, workflow_ref="echo", goal_id="g2", dispatch_key="k2"),
        _admit(client, owner, workflow_ref="echo"),
        _admit(client, owner, workflow_ref="versioned", dispatch_key="k4"),
    ]
    cancelled = client.post(f"/v1/runs/{runs[3]}/cancel", headers=owner.headers)
    assert cancelled.status_code == 200 and cancelled.json["status"] == "cancelled"
    _admit(client, other, workflow_ref="echo", goal_id="g1", dispatch_key="k0")
    return owner, runs


def test_the_list_is_newest_first_and_holds_only_the_tenants_runs(client, listed):
    owner, r = listed
    assert _ids(client, owner) == [r[4], r[3], r[2], r[1], r[0]]


def test_pages_cover_every_run_once_in_order(client, listed):
    owner, r = listed
    assert _all_pages(client, owner, "", limit=2) == [[r[4], r[3]], [r[2], r[1]], [r[0]]]
    assert _all_pages(client, owner, "", limit=5) == [[r[4], r[3], r[2], r[1], r[0]]]


@pytest.mark.parametrize("query, expected", [
    ("status=cancelled", [3]),
    ("status=queued", [4, 2, 1, 0]),
    ("status=queued,cancelled", [4, 3, 2, 1, 0]),
    ("status=running", []),
    ("goal_id=g1", [1, 0]),
    ("goal_id=nope", []),
    ("workflow_ref=versioned", [4, 1]),
    ("dispatch_key=k0", [0]),
    ("goal_id=g1&workflow_ref=echo", [0]),
    ("status=queued&dispatch_key=k4", [4]),
])
def test_each_filter_returns_exactly_the_matching_runs(client, listed, query, expected):
    owner, r = listed
    assert _ids(client, owner, query) == [r[i] for i in expected]


def test_a_filtered_list_pages_within_the_filter(client, listed):
    owner, r = listed
    assert _all_pages(client, owner, "status=queued", limit=3) == [[r[4], r[2], r[1]], [r[0]]]
