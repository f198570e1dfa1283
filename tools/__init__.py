"""Developer tools: the dependency lock (requirements_lock.py) and the image build (build-image.sh)."""
