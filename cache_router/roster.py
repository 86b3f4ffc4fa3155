"""Roster: the candidate replicas of a decision as the router reads them: their ids, each replica by id,
and their mask in the knowledge (`CacheKnowledge.live`).

Serve passes the same list to every decision (`RequestRouter._replicas_list`) until its replicas change, so
the router keeps the roster of the last list and builds another only for another list. The reports ride on
the same objects (Serve replaces a replica's `routing_stats` each period): `observe_reports` hands the
knowledge only the ones it has not seen, after one identity check per replica.
"""

import operator

_ROUTING_STATS = operator.attrgetter("routing_stats")


class Roster:
    def __init__(self, replicas, knowledge):
        self.replicas = list(replicas)
        self.ids = [r.replica_id.unique_id for r in self.replicas]
        self.by_id = dict(zip(self.ids, self.replicas))
        self.live = knowledge.live(self.ids)
        self._reports: list = [None] * len(self.replicas)  # the routing stats last handed to the knowledge

    def is_for(self, replicas) -> bool:
        return len(replicas) == len(self.replicas) and all(map(operator.is_, replicas, self.replicas))

    def observe_reports(self, knowledge) -> None:
        reports = list(map(_ROUTING_STATS, self.replicas))
        if all(map(operator.is_, reports, self._reports)):
            return
        for replica_id, report, seen in zip(self.ids, reports, self._reports):
            if report is not seen:
                knowledge.observe_report(replica_id, report)
        self._reports = reports
