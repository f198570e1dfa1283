"""gRPC plumbing shared by the master, parameter servers and workers."""
