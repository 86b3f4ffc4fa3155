"""Who may call: API keys from the config, an environment variable (a Kubernetes Secret as env) and a file (a
mounted Secret), all accepted together; a key file that cannot be read stops the start; CORS where configured."""

import httpx
import pytest

from core.app_config import AppConfig, IngressConfig
from serve_app.access import load_api_keys
from tests.http.conftest import MODEL

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def status_with(client: httpx.Client, key: str | None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return client.post("/v1/chat/completions", json=CHAT, headers=headers).status_code


def test_keys_from_the_config_the_environment_and_a_file_are_all_accepted(start_server, tmp_path, monkeypatch):
    keys_file = tmp_path / "keys"
    keys_file.write_text("# mounted from the Secret tether-api-keys\nsk-file-1\n\n  sk-file-2  \n")
    monkeypatch.setenv("TETHER_TEST_KEYS", "sk-env-1, sk-env-2,")
    server = start_server(ingress={"api_keys": ["sk-config"], "api_keys_env": "TETHER_TEST_KEYS",
                                   "api_keys_file": str(keys_file)})
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        for key in ("sk-config", "sk-env-1", "sk-env-2", "sk-file-1", "sk-file-2"):
            assert status_with(c, key) == 200, key
        for key in (None, "sk-other", "# mounted from the Secret tether-api-keys", ""):
            assert status_with(c, key) == 401, key


def test_the_default_environment_variable_turns_auth_on(start_server, monkeypatch):
    monkeypatch.setenv("TETHER_API_KEYS", "sk-from-secret")
    server = start_server()
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        assert status_with(c, None) == 401
        assert status_with(c, "sk-from-secret") == 200
        assert c.get("/openapi.json").json()["components"]["securitySchemes"]  # the schema says so too


def test_an_unreadable_key_file_fails_the_start(tmp_path, monkeypatch):
    monkeypatch.delenv("TETHER_API_KEYS", raising=False)
    with pytest.raises(ValueError, match="api_keys_file"):
        load_api_keys(IngressConfig(api_keys_file=str(tmp_path / "missing")))
    assert load_api_keys(IngressConfig(api_keys_env=None)) == ()  # no source: no auth


def test_cors_preflight_and_response_headers_only_for_configured_origins(start_server):
    server = start_server(ingress={"cors_allow_origins": ["https://chat.example.com"], "api_keys": ["sk-a"]})
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        preflight = c.options("/v1/chat/completions", headers={
            "Origin": "https://chat.example.com", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert preflight.status_code == 200  # answered before the key check: a preflight carries no key
        assert preflight.headers["access-control-allow-origin"] == "https://chat.example.com"
        assert "POST" in preflight.headers["access-control-allow-methods"]
        reply = c.post("/v1/chat/completions", json=CHAT, headers={"Origin": "https://chat.example.com",
                                                                   "Authorization": "Bearer sk-a"})
        assert reply.status_code == 200
        assert reply.headers["access-control-allow-origin"] == "https://chat.example.com"
        other = c.options("/v1/chat/completions", headers={"Origin": "https://evil.example",
                                                           "Access-Control-Request-Method": "POST"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    plain = start_server()
    with httpx.Client(base_url=plain.base_url, timeout=30) as c:
        reply = c.post("/v1/chat/completions", json=CHAT, headers={"Origin": "https://chat.example.com"})
        assert reply.status_code == 200 and "access-control-allow-origin" not in reply.headers


def test_credentials_with_any_origin_is_refused():
    with pytest.raises(ValueError, match="cors_allow_credentials"):
        AppConfig(ingress={"cors_allow_origins": ["*"], "cors_allow_credentials": True})
