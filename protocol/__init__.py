"""The vocabulary shared by the three services: plain types (``protocol.types``, torch-free)
and the one protobuf ⇄ type conversion layer (``protocol.wire``)."""
