"""Tensor and pipeline parallelism for the torch backend: one engine, several ranks running each step together.

Rank 0 is the engine's own process: it schedules, samples and serves as without parallelism, and its backend
forwards every step to the other ranks before running its own share of it. The other ranks only hold their share
of the weights and of the KV cache and run the steps they are sent (``worker.py``). Ranks are stage-major: with
``tensor_parallel_size`` N and ``pipeline_parallel_size`` M, stage s (``pipeline.py``) is ranks s*N .. s*N + N-1.

How ranks start (``launch.py``):

- By default rank 0 spawns the other N x M - 1 worker processes (``torch.multiprocessing``, "spawn" context) and
  they meet on ``127.0.0.1`` at a free port; ``MASTER_ADDR`` / ``MASTER_PORT`` override the two.
- On several nodes (``nnodes``, ``node_rank``, ``dist_init_addr``) each node's launcher spawns that node's ranks;
  all meet at ``dist_init_addr`` on node 0, and only node 0 runs the engine.
- Under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and ``LOCAL_RANK`` set, with
  ``WORLD_SIZE`` equal to N x M) every rank runs the same command and nothing is spawned: the backend of rank 0
  drives the engine as usual, while in every other rank the backend's ``load`` turns that process into a worker and
  exits it (``SystemExit(0)``) when rank 0 shuts down.

The process group is gloo on the CPU and NCCL on CUDA (rank r on ``cuda:LOCAL_RANK``). Not supported yet with more
than one rank: KV tiers (``read_kv_blocks`` / ``write_kv_blocks``), running a subset of the layers
(``execute_layers``, self-speculation) and embeddings (``embed``); pipeline stages run without CUDA graphs.
"""
