"""recship.serving.v1: stubs generated from protos/recship/serving/v1 at build time (see serving/codegen.py)."""
