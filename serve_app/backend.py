"""Backends: how the ingress reaches a ModelReplica's `generate`.

`HandleBackend` calls replicas through a Ray Serve handle (production, Ray
tests); `LocalBackend` calls one in-process ModelReplica (HTTP tests, dev).
Both return an async iterator of GenerateDeltas whose closing cancels the call,
so a client that goes away frees its sequence on the replica.
"""

from typing import AsyncIterator

from replicas.messages import GenerateDelta, GenerateRequest, RequestError

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
    def __init__(self, handle):
        self.handle = handle

    async def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        """A replica that dies mid-request costs this request a clean 503 (or an SSE error event), never a
        wrong answer; the conversation's next turn is routed to a live replica and re-prefilled there."""
        from ray.exceptions import RayActorError
        from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError

        response = None
        try:  # .remote() itself raises DeploymentUnavailableError once the deployment is known to have failed
            response = self.handle.options(stream=True).generate.remote(request)
            async for delta in response:
                yield delta
        except BackPressureError as exc:
            raise RequestError("all model replicas are busy; retry shortly", status_code=503,
                               type="server_overloaded") from exc
        except DeploymentUnavailableError as exc:
            raise RequestError(f"no model replica can serve: {DEPLOYMENT_FAILED}", status_code=503,
                               type="server_unavailable") from exc
        except (RayActorError, ReplicaUnavailableError) as exc:
            raise RequestError("the model replica serving this request went away; retry the request",
                               status_code=503, type="server_unavailable") from exc
        finally:
            if response is not None:
                try:
                    response.cancel()
                except DeploymentUnavailableError:  # nothing to cancel; keep the 503 above in OpenAI's shape
                    pass

    async def model_info(self) -> dict:
        return await self.handle.model_info.remote()
