"""The runtime layer: what every other layer of mpitrain may use (the environment's settings),
below comm and importing nothing of mpitrain."""
