"""Ray Serve's own routers for bench/serve_path/routing.py, at module level so that Serve can import them by
path in its actors (routing.py puts the repository root on the workers' PYTHONPATH)."""

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter


class TokenPrefixCacheAffinityRouter(PrefixCacheAffinityRouter):
    """Ray Serve LLM's PrefixCacheAffinityRouter, fed one character per prompt token id: the replica
    call carries a GenerateRequest (token ids), not the text its `_extract_text_from_request` looks for."""

    def _extract_text_from_request(self, pending_request) -> str:
        for arg in pending_request.args:
            ids = getattr(arg, "prompt_token_ids", None)
            if ids is not None:
                return "".join(chr(0x10000 + i) for i in ids)
        return super()._extract_text_from_request(pending_request)
