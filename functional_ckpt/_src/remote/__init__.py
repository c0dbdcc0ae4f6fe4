"""The remote tier: checkpoints copied to an object store (any fsspec URL) in the background.

``store`` reaches the object store and names its failures; ``protocol`` commits
a checkpoint there (marker object last, after every other object is confirmed);
``fetch`` downloads one and verifies every byte; ``uploader`` runs uploads off the
training thread, with retries, and across ranks; ``tier`` is what the manager
holds. fsspec is imported only when a remote is used.
"""
