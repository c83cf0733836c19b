"""G5's built-in plugins, shipped as the ``g5plugins`` package and found through the
``g5.plugins`` entry-point group like any third-party plugin. No plugin imports another."""
