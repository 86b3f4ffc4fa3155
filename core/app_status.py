"""Whether a leaving Serve replica's application stays deployed: asked by the Ingress (wait for a successor
on the port?) and by a ModelReplica's Migrator (export conversations to the StateDepot?). When the whole app
is being deleted there is nobody to hand over to: an export then waited out its 10 s timeout on a depot being
deleted too, in every `serve delete`.
"""

import asyncio
import logging

from ray import serve

logger = logging.getLogger("ray.serve")

STATUS_TIMEOUT_S = 5.0  # a leaving replica asking the controller whether its app is being deleted


async def app_deleting() -> bool | None:
    """Whether the calling replica's application is being deleted: True then, and nothing it would hand over
    (an Ingress's port, a ModelReplica's conversations) has a successor. False: it stays deployed (it is being
    replaced or scaled in), and so does a controller too busy to answer (a roll on a loaded host): the
    hand-over then costs at most its own timeout. None: not called in a Serve replica."""
    from ray.serve._private.api import _get_global_client  # PRIVATE (Ray 2.60): the controller's client
    from ray.serve.schema import ApplicationStatus

    try:
        app = serve.get_replica_context().app_name
    except Exception:  # outside Serve
        return None
    try:
        overview = await asyncio.wait_for(asyncio.to_thread(lambda: _get_global_client().get_serve_status(app)),
                                          STATUS_TIMEOUT_S)
    except Exception as exc:
        logger.info("leaving: no app status (%r); handing over as if the app stays", exc)
        return False
    return overview.app_status.status in (ApplicationStatus.DELETING, ApplicationStatus.NOT_STARTED)
