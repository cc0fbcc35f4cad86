"""Coding runs on Kubernetes: the Job of each run (`coding`) and the steps inside its pod (`runner`)."""
