"""The write-back's transports: how a layer's planned blocks reach the host tier (`base`)."""
