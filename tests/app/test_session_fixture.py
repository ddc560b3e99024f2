"""The fast tests' savepoint fixture really isolates: nothing it writes escapes."""

from tests.conftest import connect


def test_db_session_writes_are_invisible_to_other_connections(client, tx_tenant, db_session,
                                                             database_url):
    created = client.post("/v1/runs", json={"workflow_ref": "echo", "input": {}},
                          headers=tx_tenant.headers)
    assert created.status_code == 201
    with connect(database_url) as other:
        assert other.execute("SELECT count(*) FROM tenants WHERE id = %s",
                             [tx_tenant.id]).fetchone()[0] == 0
