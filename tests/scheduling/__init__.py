"""TEST-ONLY: elastic scheduling scenarios on the Kubernetes stand-in's scheduler (issue 32)."""
