"""Sidecar injection for Kubernetes: the mutating admission webhook and the sidecar spec it adds."""
