"""The Ray host: any compute kind's trainer and samplers, each in its own Ray actor (`relayrl.backends.ray.build`)."""
