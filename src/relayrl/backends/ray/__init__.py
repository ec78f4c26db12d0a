"""The Ray backend: the sim or local workers hosted in Ray actors (`relayrl.backends.ray.build`)."""
