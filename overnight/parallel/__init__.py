"""Beyond one device: tensor parallel (one model over several GPUs), data parallel (several engines),
and Ray (engines on a cluster). See docs/scaling.md.

    tp       apply_tp / load_sharded_model: each rank's share of the weights, the parallel layers
    workers  TPRunner: the engine's runner over one process per rank (typed messages over pipes)
    links    the wire between a data parallel front and its engines; ProcessLinks (local processes)
    dp       DataParallelEngine: the Engine's request methods over N engines, dealt by load
    ray      generate_dataset (a ray.data processor) and build_ray_engine / RayLinks (run-batch --ray)
"""
