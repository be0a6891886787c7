"""ringq: the Python client of the ringq broker. `ringq.v1` holds the code generated from protos/."""
