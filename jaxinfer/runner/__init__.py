"""Parameters and KV pages on the device, the pure step functions over them, their compiled variants and
the executable cache, and the host-to-device copy of a step's arrays."""
