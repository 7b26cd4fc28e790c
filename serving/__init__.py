"""Server bootstrap shared by the three services: gRPC options, health, reflection, logging,
engine-error → status mapping and the tensor wire codec."""
