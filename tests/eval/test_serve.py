"""`mtp-serve`'s entry (eval/serve.py): conf/serve.yaml composes and validates, the configured settings become the
requests' defaults, and a missing `serve` extra is one line naming it."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import eval.schema as schema
import eval.serve as serve

CONF = Path(__file__).resolve().parents[2] / "conf"


@pytest.fixture(scope="module", autouse=True)
def hydra_conf():
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield


def test_serve_config_composes_and_refuses_bad_values():
    typed = schema.validate(compose("serve"))
    assert isinstance(typed, schema.ServeConfig)
    assert (typed.host, typed.port, typed.thinking, typed.draft.name) == ("127.0.0.1", 8000, True, "eagle")
    with pytest.raises(schema.SchemaError, match="port = 70000 is invalid"):
        schema.validate(compose("serve", overrides=["port=70000"]))
    with pytest.raises(schema.SchemaError, match="draft.tree = '2x1' is invalid: expected null: mtp-serve"):
        schema.validate(compose("serve", overrides=["draft.tree=2x1"]))
    with pytest.raises(schema.SchemaError, match="draft.k"):
        schema.validate(compose("serve", overrides=["draft.k=99"]))


def test_serve_builds_the_app_with_the_configured_defaults(monkeypatch):
    from fastapi.testclient import TestClient
    import uvicorn

    started = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, host, port, **kw: started.update(app=app, host=host, port=port))
    cfg = compose("serve", overrides=["draft.k=2", "max_new_tokens=3", "port=8123", "served_model_name=mini"])
    assert serve.run(cfg) == 0
    assert (started["host"], started["port"]) == ("127.0.0.1", 8123)
    with TestClient(started["app"]) as client:
        assert client.get("/v1/models").json()["data"][0]["id"] == "mini"
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert r["usage"]["completion_tokens"] == 3 and (r["mtp"]["draft"], r["mtp"]["k"]) == ("eagle", 2)


def test_serve_without_its_extra_names_it(monkeypatch, capsys):
    monkeypatch.setitem(__import__("sys").modules, "uvicorn", None)
    assert serve.run(compose("serve")) == 2
    assert "pip install 'mtp[serve]'" in capsys.readouterr().err
