"""The parameter server: holds a partition of the model's parameters and applies workers' gradients.

* :mod:`.partition` -- which server owns which dense variable (by size) and embedding id (workers import
  it too; it imports only numpy).
* :mod:`.pieces` -- big dense variables cut into row ranges held as variables of their own (the workers'
  client cuts and joins them; a PS sees only names).
* :mod:`.embedding_table` -- lazily created embedding rows and their optimizer slot rows.
* :mod:`.optimizer` -- dense and row-wise sparse updates with the model's own Keras optimizer.
* :mod:`.parameters` -- this server's variables, tables, optimizers and model version.
* :mod:`.servicer` -- the ``ParameterServer`` gRPC service (asynchronous or synchronous SGD).
* :mod:`.checkpoint` -- saving and restoring a server's whole state.
* :mod:`.server` -- ``edl-argo ps``.
"""
