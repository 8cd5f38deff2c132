from shoal.cli.main import main

raise SystemExit(main())
