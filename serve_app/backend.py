"""Backends: how the ingress reaches a ModelReplica's `generate`.

`HandleBackend` calls replicas through a Ray Serve handle (production, Ray
tests); `LocalBackend` calls one in-process ModelReplica (HTTP tests, dev).
Both return an async iterator of GenerateDeltas whose closing cancels the call,
so a client that goes away frees its sequence on the replica.
"""

import asyncio
from typing import AsyncIterator

from core.messages import GenerateDelta, GenerateRequest, RequestError
from serve_app.channel_client import ChannelClient, replica_gone

DEPLOYMENT_FAILED = "the model deployment failed to start; `serve status` shows why"


class LocalBackend:
    def __init__(self, replica):
        self.replica = replica

    async def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        generator = self.replica.generate(request)
        try:
            async for delta in generator:
                yield delta
        finally:
            await generator.aclose()

    async def model_info(self) -> dict:
        return self.replica.model_info()


class HandleBackend:
    def __init__(self, handle, delta_channels: bool = True):
        """`delta_channels`: deltas come over one socket per replica per event loop, a frame per engine
        step (serve_app/channel_client.py); off: each delta is its own item on the handle call."""
        self.handle = handle
        self.delta_channels = delta_channels
        self._clients: dict[asyncio.AbstractEventLoop, ChannelClient] = {}  # the proxy's loop, the front door's

    async def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        """A replica that dies mid-request costs this request a clean 503 (or an SSE error event), never a
        wrong answer; the conversation's next turn is routed to a live replica and re-prefilled there."""
        from ray.exceptions import RayActorError
        from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError

        client = self._client()
        request.delta_channel = client.key if client else ""
        inbox = client.expect(request.request_id) if client else None
        response = None
        try:  # .remote() itself raises DeploymentUnavailableError once the deployment is known to have failed
            response = self.handle.options(stream=True).generate.remote(request)
            deltas = client.stream(request.request_id, inbox, response) if client else response
            async for delta in deltas:
                yield delta
        except BackPressureError as exc:
            raise RequestError("all model replicas are busy; retry shortly", status_code=503,
                               type="server_overloaded") from exc
        except DeploymentUnavailableError as exc:
            raise RequestError(f"no model replica can serve: {DEPLOYMENT_FAILED}", status_code=503,
                               type="server_unavailable") from exc
        except (RayActorError, ReplicaUnavailableError) as exc:
            raise replica_gone() from exc
        finally:
            if client:
                client.inboxes.pop(request.request_id, None)
            if response is not None:
                try:
                    response.cancel()
                except DeploymentUnavailableError:  # nothing to cancel; keep the 503 above in OpenAI's shape
                    pass

    def _client(self) -> ChannelClient | None:
        if not self.delta_channels:
            return None
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            client = self._clients[loop] = ChannelClient()
        return client

    async def model_info(self) -> dict:
        return await self.handle.model_info.remote()
