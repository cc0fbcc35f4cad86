from harnessrl.curate.clean import main

raise SystemExit(main())
