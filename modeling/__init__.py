"""Model code shared by the services: configs, weights, target and drafter forwards,
tokenizer, sampling and acceptance. Free of gRPC and protobuf."""
