"""Engine replicas as Ray actors, and offline generation spread over them.

Owns: starting N `Replica` actors (each its own process, `threads_per_replica` CPUs
and torch threads, spread over the cluster's nodes, restarted by Ray whenever its
process dies), their descriptions, and `generate` over them; the Ray instance when
it started one (see `cluster`).
Promises: `start` returns once every replica has loaded its engine, or raises with the
replica's own error (and leaves nothing running); `generate(prompts)` gives one
result per prompt, in order, with the tokens one Engine would give for the same call
(greedy or seeded: prompt i is seeded seed + i wherever it runs); a block whose
replica dies is run again once on the next replica. `close` ends the actors and a Ray
instance started here; idempotent.
Never: routes server requests (`backend` does) or plans them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from cellbatch.distributed.cluster import RayCluster, connect
from cellbatch.distributed.replica import Replica, ReplicaInfo
from cellbatch.engine import GenerationResult, Prompt
from cellbatch.generation_config import GenConfig, SamplingParams

# Loading a model in a new process: imports, weights, and the first kernel build.
START_TIMEOUT_S = 600.0


class ReplicaSet:
    """`ReplicaSet.start(model, replicas=N)`: N engines behind one `generate`."""

    def __init__(self, cluster: RayCluster, actors: list[Any], infos: list[ReplicaInfo]) -> None:
        self.cluster = cluster
        self.actors = actors
        self.infos = infos
        self._closed = False

    @classmethod
    def start(
        cls,
        model: str | None = None,
        *,
        replicas: int = 2,
        threads_per_replica: int = 1,
        ray_address: str | None = None,
        timeout: float = START_TIMEOUT_S,
        **engine_options: Any,
    ) -> ReplicaSet:
        """Start `replicas` engines of `model` (default: the embedded SmolLM2-135M;
        on a cluster, the path must exist on every node) with
        `Engine.from_pretrained`'s `engine_options`, on the Ray cluster at
        `ray_address`, on the Ray this process already runs, or on a new local Ray
        instance with replicas × threads_per_replica CPUs."""
        if replicas < 1 or threads_per_replica < 1:
            raise ValueError(
                f"replicas and threads_per_replica must be >= 1, got {replicas} and "
                f"{threads_per_replica}"
            )
        if "threads" in engine_options:
            raise ValueError("replicas take threads_per_replica, not threads")
        cluster = connect(ray_address, replicas * threads_per_replica)
        ray = cluster.ray
        actor_class = ray.remote(Replica).options(
            num_cpus=threads_per_replica,
            max_restarts=-1,  # a replica whose process dies comes back, however often
            max_task_retries=0,  # its requests in flight fail: the server decides
            scheduling_strategy="SPREAD",
        )
        path = None if model is None else str(model)
        actors = [
            actor_class.remote(index, path, threads_per_replica, engine_options)
            for index in range(replicas)
        ]
        infos = None
        try:
            infos = ray.get([actor.info.remote() for actor in actors], timeout=timeout)
        except Exception as error:
            # Ray's message holds the replica's traceback; its last line says what failed.
            lines = [line for line in str(error).splitlines() if line.strip()]
            cause = lines[-1].strip() if lines else repr(error)
            raise RuntimeError(f"a replica did not start: {cause}") from error
        finally:
            if infos is None:
                for actor in actors:
                    ray.kill(actor)
                cluster.close()
        return cls(cluster, actors, infos)

    def __len__(self) -> int:
        return len(self.actors)

    @property
    def info(self) -> ReplicaInfo:
        """Replica 0's description: the model, tokenizer and limits all replicas share."""
        return self.infos[0]

    def generate(
        self,
        prompts: Sequence[Prompt],
        params: GenConfig | SamplingParams | None = None,
        *,
        max_new_tokens: int | None = None,
        stop: Sequence[str] = (),
        seed: int | None = None,
        share_prefix: bool = True,
    ) -> list[GenerationResult]:
        """`Engine.generate` over the replicas: the prompts cut into one contiguous
        block per replica (so that prompts next to each other share their prefix on
        one engine); results in prompt order."""
        self._require_open()
        ray = self.cluster.ray
        options = {
            "max_new_tokens": max_new_tokens,
            "stop": tuple(stop),
            "seed": seed,
            "share_prefix": share_prefix,
        }
        size = max(1, math.ceil(len(prompts) / len(self.actors)))
        blocks = [
            (first, list(prompts[first : first + size])) for first in range(0, len(prompts), size)
        ]
        calls = [
            self.actors[number].generate.remote(block, params, options, first)
            for number, (first, block) in enumerate(blocks)
        ]
        results: list[GenerationResult] = []
        for number, ((first, block), call) in enumerate(zip(blocks, calls, strict=True)):
            try:
                results.extend(ray.get(call))
            except ray.exceptions.RayActorError:
                # Its replica died (Ray restarts it): run the block once more elsewhere.
                again = self.actors[(number + 1) % len(self.actors)]
                results.extend(ray.get(again.generate.remote(block, params, options, first)))
        return results

    def close(self) -> None:
        """End every replica (and the Ray instance started here); idempotent."""
        if self._closed:
            return
        self._closed = True
        ray = self.cluster.ray
        if ray.is_initialized():
            for actor in self.actors:
                ray.kill(actor)
        self.cluster.close()

    def __enter__(self) -> ReplicaSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _require_open(self) -> None:
        if self._closed:
            raise RuntimeError("the replicas are closed; start a new ReplicaSet")
