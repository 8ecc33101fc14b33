"""The every-sample features: the live view, hindsight spans fetched from the nodes' rings, incidents."""
