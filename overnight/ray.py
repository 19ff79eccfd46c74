"""Ray integration (optional extra: pip install 'overnight[ray]'): a processor for
ray.data.Dataset.map_batches, and engines as replicas on a cluster. See docs/scaling.md."""

from overnight.parallel.ray import EngineActor, build_ray_engine, generate_dataset, require_ray

__all__ = ["EngineActor", "build_ray_engine", "generate_dataset", "require_ray"]
