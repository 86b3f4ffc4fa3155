"""A real StateDepot called the way a Serve handle is (`await handle.method.remote(...)`), in this process:
the migration tests that need no Ray (tests/http/test_migration.py) give it to their replicas' migrators."""

from replicas.depot import StateDepot


class _Method:
    def __init__(self, fn, depot: "InProcessDepot"):
        self.fn = fn
        self.depot = depot

    def remote(self, *args):
        async def call():
            if self.depot.gone:
                raise ConnectionError("the StateDepot's actor died")
            return self.fn(*args)
        return call()


class InProcessDepot:
    def __init__(self, depot: StateDepot | None = None):
        self.target = depot or StateDepot()
        self.gone = False  # True: every call raises, as a handle to a dead actor does

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self.target, name), self)
