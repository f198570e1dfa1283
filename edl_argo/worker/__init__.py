"""The worker: asks the master for tasks, reads their records, computes gradients, pushes them to the PS."""
