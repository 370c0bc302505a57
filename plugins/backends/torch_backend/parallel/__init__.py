"""Tensor parallelism for the torch backend: one engine, several ranks of one node running each step together.

Rank 0 is the engine's own process: it schedules, samples and serves as without parallelism, and its backend
forwards every step to the other ranks before running its own share of it. The other ranks only hold their shard
of the weights and of the KV cache and run the steps they are sent (``worker.py``).

How ranks start (``launch.py``):

- By default rank 0 spawns ``tensor_parallel_size - 1`` worker processes (``torch.multiprocessing``, "spawn"
  context) and they meet on ``127.0.0.1`` at a free port; ``MASTER_ADDR`` / ``MASTER_PORT`` override the two.
- Under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and ``LOCAL_RANK`` set, with
  ``WORLD_SIZE`` equal to the tensor-parallel size) every rank runs the same command and nothing is spawned: the
  backend of rank 0 drives the engine as usual, while in every other rank the backend's ``load`` turns that
  process into a worker and exits it (``SystemExit(0)``) when rank 0 shuts down.

The process group is gloo on the CPU and NCCL on CUDA (rank r on ``cuda:LOCAL_RANK``). Not supported yet with
``tensor_parallel_size > 1``: KV tiers (``read_kv_blocks`` / ``write_kv_blocks``), running a subset of the layers
(``execute_layers``, self-speculation), embeddings (``embed``) and CUDA graphs (steps run eagerly).
"""
