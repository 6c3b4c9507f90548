"""An agent that never starts its ranks (``python -m sleeping_agent RUN_DIR``): a rendezvous that hangs."""
import time

if __name__ == "__main__":
    time.sleep(600)
