"""The pure core: policy that takes the time as an argument and never does I/O."""
