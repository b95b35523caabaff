"""What-if simulation: a trace replayed through the proxy's own core on a virtual clock."""
