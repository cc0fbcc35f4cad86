// Token ids load when their <details> opens (they can run to megabytes per rollout).
"use strict";
document.addEventListener("toggle", async (event) => {
  const box = event.target;
  if (!(box instanceof HTMLDetailsElement) || !box.open || !box.dataset.src || box.dataset.loaded) {
    return;
  }
  box.dataset.loaded = "1";
  try {
    const reply = await fetch(box.dataset.src, { credentials: "same-origin" });
    const page = new DOMParser().parseFromString(await reply.text(), "text/html");
    const part = page.getElementById("tokens") || page.getElementById("error");
    if (part) {
      box.replaceChildren(box.querySelector("summary"), document.importNode(part, true));
    }
  } catch (err) {
    box.dataset.loaded = "";
  }
}, true);
