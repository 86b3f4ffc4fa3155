"""bench/router_sim.py at `--quick` size (16 replicas), run as its command: the router's invariants, not its speed.

- without churn, every next turn goes to the replica holding its conversation;
- when 10% of the replicas leave at once, every conversation on a survivor stays put (rendezvous hashing
  moves only the keys the departed replicas owned), and each moved one lands on its key's next rendezvous
  choice among the survivors, so the moved ones spread over the survivors.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NUM_REPLICAS, LEAVE = 16, 0.1  # the --quick size, the default share leaving


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    path = tmp_path_factory.mktemp("router_sim") / "results.json"
    run = subprocess.run([sys.executable, "-m", "bench.router_sim", "--quick", "--json", str(path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return json.loads(path.read_text()), run.stdout


def test_next_turns_go_to_the_conversations_replica(quick):
    results, _ = quick
    assert results["replicas"] == NUM_REPLICAS
    assert results["affinity"] == 1.0


def test_conversations_on_survivors_stay_and_moved_ones_spread(quick):
    results, _ = quick
    assert results["num_left"] == round(LEAVE * NUM_REPLICAS) == 2
    assert results["survivors_stayed"] == 1.0
    assert results["on_holder_after_leave"] + results["moved"] == pytest.approx(1.0)
    assert 0 < results["moved"] < 0.3
    assert results["moved_on_next_choice"] == 1.0
    assert results["moved_spread"] >= 0.75 * results["num_survivors"]
    assert results["moved_max_share"] <= 3 / results["num_survivors"]


def test_the_table_names_every_measure(quick):
    _, table = quick
    for measure in ("next turn decision", "router memory per live conversation", "affinity",
                    "conversations on survivors that stayed", "most one receives", "Serve broadcast"):
        assert measure in table


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
