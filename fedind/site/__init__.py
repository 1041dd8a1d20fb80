"""The site agent: the ClientApp that trains at a production line, its persistent state and
data cache."""
