"""A ModelReplica whose engine breaks on cue: the engine-thread-raises drill (bench/reliability/drills.py,
tests/ray/test_drills.py). A request asking for `fault_max_tokens` tokens makes the replica's engine step
raise once it has streamed `arm_after_tokens`: an engine bug, on the step thread, in a real replica."""


def faulty_replica_class(fault_max_tokens: int, arm_after_tokens: int):
    """Defined in a function so that Ray pickles the class by value (workers need not import this module)."""
    from replicas.deployment import ModelReplica

    class FaultyReplica(ModelReplica):
        async def _deltas(self, request):  # a request's deltas, whichever way they travel back
            armed = request.sampling.max_tokens != fault_max_tokens
            async for delta in super()._deltas(request):
                yield delta
                # Some deltas in first: its caller has seen which replica it broke (Serve may hold back a
                # first delta that an error follows at once).
                if not armed and delta.num_generated_tokens >= arm_after_tokens:
                    armed = True
                    self.engine.engine.step = self.failing_step

        @staticmethod
        def failing_step():
            raise RuntimeError("drill: an engine step raised")

    return FaultyReplica
