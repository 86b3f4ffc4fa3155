"""Who may call the API: the bearer keys an Ingress accepts, and the browser origins CORS lets in.

Keys come from the config, an environment variable and a file, read once at start.

A key in the config's `api_keys` ends up wherever the config does (a RayService custom resource, the Ray
dashboard); a Kubernetes Secret given as an environment variable (`api_keys_env`, comma-separated) or mounted as
a file (`api_keys_file`, one key per line) keeps it out of both. Every source adds; none: no auth.
"""

import os

from core.app_config import IngressConfig


def load_api_keys(ingress: IngressConfig) -> tuple[str, ...]:
    """The accepted keys, deduplicated, in the order found. A missing or unreadable `api_keys_file` raises:
    an Ingress that would silently serve without the keys it was given must not start."""
    keys = list(ingress.api_keys)
    if ingress.api_keys_env:
        keys += [key.strip() for key in os.environ.get(ingress.api_keys_env, "").split(",")]
    if ingress.api_keys_file:
        try:
            with open(ingress.api_keys_file) as f:
                lines = f.read().splitlines()
        except OSError as exc:
            raise ValueError(f"ingress.api_keys_file: cannot read {ingress.api_keys_file!r}: {exc}") from exc
        keys += [line.strip() for line in lines if not line.lstrip().startswith("#")]
    return tuple(dict.fromkeys(key for key in keys if key))


def install_cors(app, ingress: IngressConfig) -> None:
    """Starlette's CORS middleware where origins are configured; it answers preflight OPTIONS itself, before
    the API-key check (a browser sends no Authorization header on a preflight)."""
    if not ingress.cors_allow_origins:
        return
    from fastapi.middleware.cors import CORSMiddleware

    app.add_middleware(CORSMiddleware, allow_origins=list(ingress.cors_allow_origins),
                       allow_methods=list(ingress.cors_allow_methods), allow_headers=list(ingress.cors_allow_headers),
                       allow_credentials=ingress.cors_allow_credentials)
