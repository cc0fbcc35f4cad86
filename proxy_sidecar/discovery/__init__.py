"""Upstream discovery: a Kubernetes Service named as `k8s://NAMESPACE/SERVICE:PORT` → its replicas."""
