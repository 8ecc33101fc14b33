"""History and the pictures drawn from it: the embedded history and Prometheus behind one
interface, and the fleet's picture."""
