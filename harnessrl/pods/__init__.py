"""Runs on Kubernetes: a Job per harness run (`k8s`, through `k8s_api`), the Job of a coding run
(`coding`) and the steps inside its pod (`runner`)."""
