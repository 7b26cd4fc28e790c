"""Server bootstrap shared by the three services: gRPC options, health, reflection, logging."""
