"""DCP's storage seam: ``dcp.save``/``dcp.load`` writing and reading this project's format."""
