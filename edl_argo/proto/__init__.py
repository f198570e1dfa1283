"""The generated protobuf and gRPC modules (``make proto`` from the ``*.proto`` files here); they import
nothing of edl_argo outside this package."""
