"""What plugins see: the hook specifications, the plugin manager, plugin options, dimensions, errors, and the contract suite for plugin authors."""
