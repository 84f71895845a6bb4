"""The layer between comm (collectives over MPI) and the training loop: DistributedOptimizer
(optimizer.py, a facade over one strategy: gradients.py, weights.py or deterministic.py),
gradient accumulation's bookkeeping (accumulation.py) and the broadcasts that make every replica
start from one model (broadcast.py). docs/architecture.md draws the layers.
"""
