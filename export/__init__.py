"""Export pipeline: checkpoint -> quantize -> reshard -> fx-trace -> TorchScript artifact."""
