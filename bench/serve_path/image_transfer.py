"""What an image costs on its way from the ingress to a replica: one Ray Serve handle call carrying a
GenerateRequest with N bytes of image, through a real local Serve app, vs the same request without one.

    python -m bench.serve_path.image_transfer [--calls 30]

Ray passes an argument past its inline limit (100 KiB) through the object store on its own, so the
ingress sends the bytes in the request; this measures what that costs (median ms per call). Prints the
CPU flags first.
"""

import argparse
import os
import statistics
import time

from ray import serve

from bench.common import host_line, local_ray_defaults, percentile
from core.messages import GenerateRequest, ImageInput, SamplingParams

SIZES = {"none": 0, "100 KB": 100_000, "1 MB": 1_000_000, "8 MB": 8_000_000}


@serve.deployment(max_ongoing_requests=8)
class Receiver:
    def receive(self, request: GenerateRequest) -> int:
        return sum(len(image.data) for image in request.images)


def request(num_bytes: int) -> GenerateRequest:
    images = [ImageInput(os.urandom(num_bytes), 1, 1, "0" * 64)] if num_bytes else []
    return GenerateRequest("r", [1, 2, 3], SamplingParams(max_tokens=1), images=images)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()
    local_ray_defaults()
    import ray

    print(host_line())
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    handle = serve.run(Receiver.bind(), name="transfer", route_prefix=None)
    for name, num_bytes in SIZES.items():
        payload = request(num_bytes)
        assert handle.receive.remote(payload).result() == num_bytes  # warm-up, and the bytes arrive whole
        times = []
        for _ in range(args.calls):
            start = time.perf_counter()
            handle.receive.remote(payload).result()
            times.append((time.perf_counter() - start) * 1e3)
        print(f"{name:>7}: median {statistics.median(times):.1f} ms per call, p90 "
              f"{percentile(times, 0.9):.1f} ms ({args.calls} calls)")
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
