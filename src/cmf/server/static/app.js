// cmf chat page: talks to this server's /v1/chat/completions with streaming (Server-Sent Events
// read through fetch + ReadableStream, so that the request can carry a bearer key and be stopped
// with an AbortController; EventSource can do neither).
//
// Before each request the page asks /v1/tokenize how many tokens the conversation takes after the
// chat template: max_tokens is capped to what the context leaves, and a conversation that no
// longer fits is not sent at all (the server would refuse it with context_length_exceeded).
//
// Model output is only ever put into the page as text (textContent / Text nodes), never parsed
// as HTML: a model can emit any markup.
"use strict";

(() => {
  const STORE_CONVERSATION = "cmf.webui.conversation";
  const STORE_KEY = "cmf.webui.apiKey";
  const DEFAULT_SETTINGS = {
    system: "", temperature: 0.8, top_p: 0.95, max_tokens: 512, task: "", skill: "", extra: "",
  };
  const SAVE_EVERY_MS = 1000;
  const COUNT_DELAY_MS = 250;  // the live context count waits for a pause in typing

  const $ = (id) => document.getElementById(id);
  const el = {
    modelName: $("model-name"), log: $("log"), empty: $("empty"), status: $("status"),
    form: $("composer"), composerError: $("composer-error"), prompt: $("prompt"), send: $("send"),
    context: $("context"),
    stop: $("stop"), newChat: $("new-chat"),
    panel: $("panel"), panelToggle: $("panel-toggle"), layout: document.querySelector(".layout"),
    modelError: $("model-error"), facts: $("model-facts"), dtypeBody: document.querySelector("#dtype-table tbody"),
    task: $("task"), skill: $("skill"), quality: $("quality-list"),
    system: $("system"), temperature: $("temperature"), topP: $("top-p"), maxTokens: $("max-tokens"),
    extra: $("extra"), forgetKey: $("forget-key"),
    keyDialog: $("key-dialog"), keyForm: $("key-form"), keyInput: $("api-key"), keyReason: $("key-reason"),
    template: $("message-template"),
  };

  const state = {
    conversation: loadConversation(),
    modelId: null,       // the id /v1/models lists; sent as "model"
    card: null,          // the model card's "cmf" block
    controller: null,    // AbortController of the request in flight
    afterKey: null,      // what to retry once a key has been entered
    counted: null,       // the last live count: {used, ctx, left}, or null while unknown
    countSeq: 0,         // the number of the latest live count (older answers are dropped)
    countTimer: null,
  };

  // ------------------------------------------------------------------------------ storage

  function loadConversation() {
    let saved = null;
    try {
      saved = JSON.parse(localStorage.getItem(STORE_CONVERSATION) || "null");
    } catch (_) {
      saved = null;  // unreadable (edited by hand, older format): start afresh rather than fail
    }
    const conversation = {
      messages: Array.isArray(saved && saved.messages) ? saved.messages : [],
      settings: Object.assign({}, DEFAULT_SETTINGS, saved && saved.settings),
    };
    // A reply still marked as streaming was cut off by a reload or a closed tab.
    for (const m of conversation.messages) {
      if (m.role === "assistant" && m.pending) {
        delete m.pending;
        m.stats = Object.assign({}, m.stats, { finish: "interrupted" });
      }
    }
    return conversation;
  }

  function saveConversation() {
    try {
      localStorage.setItem(STORE_CONVERSATION, JSON.stringify(state.conversation));
    } catch (err) {
      setStatus(`Could not save the conversation in this browser: ${err.message}`);
    }
  }

  const getKey = () => localStorage.getItem(STORE_KEY) || "";

  // ------------------------------------------------------------------------------ HTTP

  function headers(json) {
    const h = {};
    if (json) h["Content-Type"] = "application/json";
    const key = getKey();
    if (key) h["Authorization"] = `Bearer ${key}`;
    return h;
  }

  // The server's error object ({"error": {message, type, param, code}}) as one readable line.
  function describeError(status, error) {
    if (!error || typeof error !== "object") return `Error ${status}`;
    const details = [error.code, error.param && `param ${error.param}`].filter(Boolean).join(", ");
    const head = status ? `Error ${status}` : "Error";
    return `${head}${details ? ` (${details})` : ""}: ${error.message || "no message"}`;
  }

  async function errorOf(response) {
    let body = null;
    try {
      body = await response.json();
    } catch (_) {
      body = null;
    }
    return describeError(response.status, body && body.error ? body.error : { message: response.statusText });
  }

  // Yields the data payload of each Server-Sent Event in the response body.
  async function* sseData(response) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    let data = [];
    const takeLines = function* () {
      let nl;
      while ((nl = buffer.indexOf("\n")) >= 0) {
        let line = buffer.slice(0, nl);
        buffer = buffer.slice(nl + 1);
        if (line.endsWith("\r")) line = line.slice(0, -1);
        if (line === "") {  // a blank line ends an event
          if (data.length) yield data.join("\n");
          data = [];
        } else if (!line.startsWith(":")) {  // ":" starts a comment line
          const colon = line.indexOf(":");
          const field = colon < 0 ? line : line.slice(0, colon);
          let value = colon < 0 ? "" : line.slice(colon + 1);
          if (value.startsWith(" ")) value = value.slice(1);
          if (field === "data") data.push(value);
        }
      }
    };
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        // stream: true keeps a UTF-8 character split across network chunks whole.
        buffer += decoder.decode(value, { stream: true });
        yield* takeLines();
      }
      buffer += decoder.decode() + "\n\n";
      yield* takeLines();
    } finally {
      // The reader stopped early (an error event, [DONE]): let go of the connection.
      reader.cancel().catch(() => {});
    }
  }

  // ------------------------------------------------------------------------------ API key

  function askKey(reason, retry) {
    el.keyReason.textContent = reason;
    el.keyInput.value = "";
    state.afterKey = retry || null;
    if (!el.keyDialog.open) el.keyDialog.showModal();
    el.keyInput.focus();
  }

  el.keyForm.addEventListener("submit", () => {
    // method="dialog": the browser closes the dialog after this handler.
    const key = el.keyInput.value.trim();
    if (key) localStorage.setItem(STORE_KEY, key);
    const retry = state.afterKey;
    state.afterKey = null;
    if (retry) retry();
  });

  el.forgetKey.addEventListener("click", () => {
    localStorage.removeItem(STORE_KEY);
    askKey("Enter the API key for this server.", loadModel);
  });

  // ------------------------------------------------------------------------------ model panel

  function formatCount(n) {
    if (typeof n !== "number") return "?";
    const units = [[1e12, "T"], [1e9, "B"], [1e6, "M"], [1e3, "K"]];
    for (const [size, unit] of units) {
      if (n >= size) return `${(n / size).toFixed(n / size < 10 ? 2 : 1)} ${unit}`;
    }
    return String(n);
  }

  function formatBytes(n) {
    if (typeof n !== "number") return "?";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) {
      n /= 1024;
      i += 1;
    }
    return `${i ? n.toFixed(1) : n} ${units[i]}`;
  }

  // Share of the backbone's weights stored in each dtype (skill replacements are counted apart).
  function dtypeMix(dtypes) {
    const byDtype = new Map();
    let total = 0;
    for (const row of dtypes || []) {
      if (row.family === "skill") continue;
      byDtype.set(row.dtype, (byDtype.get(row.dtype) || 0) + row.params);
      total += row.params;
    }
    if (!total) return "?";
    return [...byDtype.entries()].sort((a, b) => b[1] - a[1])
      .map(([dtype, params]) => `${dtype} ${(100 * params / total).toFixed(params / total < 0.01 ? 2 : 1)}%`)
      .join(", ");
  }

  // Quality of a task mask as `cmf info` summarizes it: the held-out perplexity ratio, or null.
  function taskQuality(task) {
    return typeof task.quality === "number" ? `held-out ppl ×${task.quality.toFixed(3)}` : null;
  }

  // Quality of a skill: the record as written by `cmf skill add --quality` (a measured
  // backbone/overlaid perplexity), any other metric with a value, or null when nothing was measured.
  function skillQuality(skill) {
    const q = skill.quality;
    if (!q || typeof q !== "object" || !q.metric) return null;
    if (typeof q.backbone === "number" && typeof q.overlaid === "number") {
      return `${q.metric} ${q.backbone} → ${q.overlaid} (backbone → skill)`;
    }
    if (typeof q.value === "number") return `${q.metric} ${q.value}`;
    return q.metric;
  }

  function addFact(term, value) {
    const dt = document.createElement("dt");
    dt.textContent = term;
    const dd = document.createElement("dd");
    dd.textContent = value;
    el.facts.append(dt, dd);
  }

  function option(select, value, label) {
    const o = document.createElement("option");
    o.value = value;
    o.textContent = label;
    select.append(o);
  }

  function qualityItem(label, quality) {
    const li = document.createElement("li");
    li.append(`${label}: `);
    const span = document.createElement("span");
    span.textContent = quality || "unmeasured";
    if (!quality) span.className = "unmeasured";
    li.append(span);
    el.quality.append(li);
  }

  function renderModel() {
    const card = state.card;
    el.modelName.textContent = state.modelId || "no model";
    document.title = state.modelId ? `${state.modelId} · cmf chat` : "cmf chat";
    el.facts.replaceChildren();
    el.dtypeBody.replaceChildren();
    el.task.replaceChildren();
    el.skill.replaceChildren();
    el.quality.replaceChildren();
    if (!card) return;

    const arch = card.arch || {};
    const layerKinds = Object.entries(arch.layer_types || {}).map(([k, n]) => `${n}× ${k}`).join(", ");
    addFact("Model", state.modelId);
    addFact("Architecture", `${arch.arch_name || "?"}, ${arch.num_layers ?? "?"} layers` +
      (layerKinds ? ` (${layerKinds})` : "") + `, hidden ${arch.hidden_size ?? "?"}`);
    addFact("Parameters", formatCount(card.parameters) +
      (card.skill_parameters ? ` (+${formatCount(card.skill_parameters)} in skills)` : ""));
    addFact("Quantization", `${card.quant_type || "?"}: ${dtypeMix(card.dtypes)}`);
    addFact("File size", formatBytes(card.size));
    addFact("Context", `${card.ctx_size ?? "?"} tokens`);

    for (const row of card.dtypes || []) {
      const tr = document.createElement("tr");
      for (const v of [row.family, row.dtype, formatCount(row.params), row.bits_per_weight ?? "–"]) {
        const td = document.createElement("td");
        td.textContent = String(v);
        tr.append(td);
      }
      el.dtypeBody.append(tr);
    }

    const masks = (card.masks && card.masks.tasks) || [];
    const maskByName = new Map(masks.map((m) => [m.name, m]));
    const tasks = card.tasks || [];
    // The server's --task, else the file's own default task.
    const defaultTask = card.default_task || (card.masks && card.masks.default_task);
    option(el.task, "", `file default${defaultTask ? ` (${defaultTask})` : ""}`);
    for (const name of tasks) {
      const m = maskByName.get(name) || { name };
      const q = taskQuality(m);
      option(el.task, name, `${name} — ${q || "unmeasured"}`);
      const sparsity = typeof m.sparsity === "number" ? ` (${(100 * m.sparsity).toFixed(0)}% of FFN off)` : "";
      qualityItem(`task ${name}${sparsity}`, q);
    }
    el.task.disabled = tasks.length === 0;

    const skills = card.skill_info || (card.skills || []).map((id) => ({ id }));
    option(el.skill, "", `server default (${card.default_skill || "none"})`);
    option(el.skill, "none", "none (backbone)");
    for (const s of skills) {
      const q = skillQuality(s);
      option(el.skill, s.id, `${s.id} — ${q || "unmeasured"}`);
      qualityItem(`skill ${s.id}${s.name && s.name !== s.id ? ` (${s.name})` : ""}`, q);
    }
    if (skills.length) {
      option(el.skill, "auto", "auto (route each message)");
      option(el.skill, "blend:auto", "auto blend (two best skills)");
    }
    el.skill.disabled = skills.length === 0;
    applySettingsToForm();
  }

  async function loadModel() {
    el.modelError.hidden = true;
    try {
      const list = await fetch("/v1/models", { headers: headers(false) });
      if (list.status === 401) {
        const reason = getKey() ? "The server refused this API key. Enter the right one."
          : "This server needs an API key.";
        localStorage.removeItem(STORE_KEY);
        askKey(reason, loadModel);
        throw new Error(await errorOf(list));
      }
      if (!list.ok) throw new Error(await errorOf(list));
      const models = (await list.json()).data || [];
      if (!models.length) throw new Error("the server lists no model");
      state.modelId = models[0].id;
      const full = await fetch(`/v1/models/${encodeURIComponent(state.modelId)}`, { headers: headers(false) });
      if (!full.ok) throw new Error(await errorOf(full));
      state.card = (await full.json()).cmf || {};
    } catch (err) {
      el.modelError.textContent = `Model information unavailable: ${err.message}`;
      el.modelError.hidden = false;
    }
    renderModel();
    refreshContext();
  }

  // ------------------------------------------------------------------------------ settings

  function applySettingsToForm() {
    const s = state.conversation.settings;
    el.system.value = s.system;
    el.temperature.value = s.temperature ?? "";
    el.topP.value = s.top_p ?? "";
    el.maxTokens.value = s.max_tokens ?? "";
    el.extra.value = s.extra;
    // The choices exist once the model card has come; a choice this server's file does not
    // offer (another model on the same address) then falls back to the default.
    if (!state.card) return;
    for (const [select, key] of [[el.task, "task"], [el.skill, "skill"]]) {
      const known = [...select.options].some((o) => o.value === s[key]);
      if (!known) s[key] = "";
      select.value = s[key];
    }
  }

  const numberOrNull = (input) => (input.value.trim() === "" ? null : Number(input.value));

  function readSettingsFromForm() {
    const s = state.conversation.settings;
    Object.assign(s, {
      system: el.system.value, temperature: numberOrNull(el.temperature), top_p: numberOrNull(el.topP),
      max_tokens: numberOrNull(el.maxTokens), extra: el.extra.value,
    });
    if (state.card) {  // before the card, the selects are empty: keep the saved choice
      s.task = el.task.value;
      s.skill = el.skill.value;
    }
    saveConversation();
  }

  for (const input of [el.system, el.temperature, el.topP, el.maxTokens, el.task, el.skill, el.extra]) {
    input.addEventListener("change", readSettingsFromForm);
  }
  // The system prompt and template options in the extra fields take context too.
  for (const input of [el.system, el.extra]) input.addEventListener("change", scheduleContext);
  el.prompt.addEventListener("input", scheduleContext);

  // The "cmf" object of a request: only what the user chose, so the server's defaults apply otherwise.
  function selection(settings) {
    const cmf = {};
    if (settings.task) cmf.task = settings.task;
    if (settings.skill === "blend:auto") cmf.blend = "auto";
    else if (settings.skill) cmf.skill = settings.skill;
    return Object.keys(cmf).length ? cmf : null;
  }

  // The messages a request carries: the system prompt, the conversation, then ``draft`` (the
  // message about to be sent) when it is not blank.
  function conversationMessages(settings, draft) {
    const messages = [];
    if (settings.system.trim()) messages.push({ role: "system", content: settings.system });
    for (const m of state.conversation.messages) {
      // Failed or empty replies are not part of what the model said.
      if (m.role === "user" || (m.role === "assistant" && m.content)) {
        messages.push({ role: m.role, content: m.content });
      }
    }
    if (draft && draft.trim()) messages.push({ role: "user", content: draft });
    return messages;
  }

  function requestBody(settings, extra, messages) {
    const body = {};
    if (state.modelId) body.model = state.modelId;
    if (settings.temperature !== null) body.temperature = settings.temperature;
    if (settings.top_p !== null) body.top_p = settings.top_p;
    if (settings.max_tokens !== null) body.max_tokens = settings.max_tokens;
    const cmf = selection(settings);
    if (cmf) body.cmf = cmf;
    // The user's extra fields may override the above, but not what the page itself relies on.
    return Object.assign(body, extra, { messages, stream: true, stream_options: { include_usage: true } });
  }

  function parseExtra(text) {
    if (!text.trim()) return {};
    let value;
    try {
      value = JSON.parse(text);
    } catch (err) {
      throw new Error(`Extra request fields are not valid JSON: ${err.message}`);
    }
    if (!value || typeof value !== "object" || Array.isArray(value)) {
      throw new Error("Extra request fields must be a JSON object, like {\"top_k\": 40}");
    }
    return value;
  }

  // ------------------------------------------------------------------------------ context

  const formatTokens = (n) => n.toLocaleString("en-US");

  // How many tokens ``body`` takes after the chat template: {ok, used, ctx, left} from the server's
  // /v1/tokenize (``left`` is the largest max_tokens it can serve), or {ok: false, status, error}.
  async function countTokens(body, signal) {
    const response = await fetch("/v1/tokenize", {
      method: "POST", headers: headers(true), body: JSON.stringify(body), signal,
    });
    if (!response.ok) return { ok: false, status: response.status, error: await errorOf(response) };
    const d = await response.json();
    return { ok: true, used: d.prompt_tokens, ctx: d.ctx_size, left: d.max_tokens };
  }

  // max_tokens (and the newer max_completion_tokens, which the server prefers) no larger than
  // what the context leaves; absent, the server already generates up to the context.
  function capBudget(body, left) {
    let capped = null;
    for (const key of ["max_tokens", "max_completion_tokens"]) {
      if (typeof body[key] === "number" && body[key] > left) {
        body[key] = left;
        capped = left;
      }
    }
    return capped;
  }

  function renderContext() {
    const c = state.counted;
    const ctx = c ? c.ctx : state.card && state.card.ctx_size;
    el.context.hidden = typeof ctx !== "number";
    if (el.context.hidden) return;
    const full = Boolean(c) && c.left < 1;
    el.context.classList.toggle("full", full);
    if (!c) {
      el.context.textContent = `context: ? / ${formatTokens(ctx)} tokens used`;
    } else if (full) {
      el.context.textContent = `context: ${formatTokens(c.used)} / ${formatTokens(ctx)} tokens used · ` +
        "the conversation no longer fits: start a new chat";
    } else {
      el.context.textContent = `context: ${formatTokens(c.used)} / ${formatTokens(ctx)} tokens used · ` +
        `${formatTokens(c.left)} left for the reply`;
    }
  }

  // Count the conversation with what is typed so far, and show it by the message box.
  async function refreshContext() {
    clearTimeout(state.countTimer);
    state.countTimer = null;
    const seq = ++state.countSeq;
    const settings = state.conversation.settings;
    const messages = conversationMessages(settings, el.prompt.value);
    const ctx = state.card && state.card.ctx_size;
    if (!messages.length) {  // nothing to template yet
      state.counted = typeof ctx === "number" ? { used: 0, ctx, left: ctx } : null;
      renderContext();
      return;
    }
    let extra = {};
    try {
      extra = parseExtra(settings.extra);
    } catch (_) {
      extra = {};  // said when sending; the count goes on without the extra fields
    }
    let counted = null;
    try {
      const got = await countTokens(requestBody(settings, extra, messages));
      if (got.ok) counted = got;
    } catch (_) {
      counted = null;  // the server is unreachable: sending will say so
    }
    if (seq !== state.countSeq) return;  // a newer count was asked for meanwhile
    state.counted = counted;
    renderContext();
  }

  function scheduleContext() {
    clearTimeout(state.countTimer);
    state.countTimer = setTimeout(refreshContext, COUNT_DELAY_MS);
  }

  // ------------------------------------------------------------------------------ messages

  function statsText(stats) {
    if (!stats) return "";
    const parts = [];
    if (typeof stats.tokens === "number") parts.push(`${stats.tokens} tokens`);
    if (typeof stats.tps === "number" && isFinite(stats.tps)) parts.push(`${stats.tps.toFixed(1)} tok/s`);
    if (typeof stats.ttft_ms === "number") parts.push(`first token ${Math.round(stats.ttft_ms)} ms`);
    // the prefix cache: prompt tokens whose KV the server kept from earlier turns
    if (typeof stats.prompt === "number") {
      const cached = typeof stats.cached === "number" ? stats.cached : 0;
      parts.push(`prompt ${formatTokens(stats.prompt)} tokens, ${formatTokens(cached)} cached`);
    }
    if (stats.finish) parts.push(`finish: ${stats.finish}`);
    if (typeof stats.capped === "number") parts.push(`max tokens capped at ${stats.capped} by the context`);
    if (stats.task) parts.push(`task: ${stats.task}`);
    if (stats.ran) parts.push(stats.ran);
    return parts.join(" · ");
  }

  // What ran, from the response's cmf object: the skill, the blend, or what "auto" picked.
  function ranText(cmf, asked) {
    if (!cmf) return "";
    const blend = cmf.blend || (cmf.route && cmf.route.blend);
    if (blend && typeof blend === "object" && Object.keys(blend).length) {
      const mix = Object.entries(blend)
        .map(([id, w]) => `${id === "none" ? "backbone" : id} ${Number(w).toFixed(2)}`);
      return `blend${asked === "blend:auto" ? " (auto)" : ""}: ${mix.join(" + ")}`;
    }
    const skill = cmf.skill || "backbone";
    if (asked === "auto" || asked === "blend:auto" || cmf.route) return `skill: auto → ${skill}`;
    return `skill: ${skill}`;
  }

  function messageNode(message) {
    const node = el.template.content.firstElementChild.cloneNode(true);
    node.classList.add(message.role);
    const who = message.role === "user" ? "You" : "Model";
    node.querySelector(".role").textContent = who;
    const copy = node.querySelector(".copy");
    copy.setAttribute("aria-label", message.role === "user" ? "Copy your message" : "Copy the reply");
    copy.addEventListener("click", () => copyText(message.content, copy));
    // One Text node that grows with appendData: no re-render of the whole reply per token.
    const text = document.createTextNode(message.content);
    node.querySelector(".content").append(text);
    node._text = text;
    updateMessageNode(node, message);
    return node;
  }

  function updateMessageNode(node, message) {
    const error = node.querySelector(".error-text");
    error.textContent = message.error || "";
    error.hidden = !message.error;
    node.querySelector(".stats").textContent = statsText(message.stats);
    renderToolCalls(node, message.tool_calls);
    node.classList.toggle("streaming", Boolean(message.pending));
    node.setAttribute("aria-busy", message.pending ? "true" : "false");
  }

  // One small block per tool call the model made: its name and its arguments (JSON text).
  function renderToolCalls(node, calls) {
    const list = node.querySelector(".tool-calls");
    if (!list) return;
    list.hidden = !(calls && calls.length);
    list.replaceChildren(...(calls || []).map((call) => {
      const item = document.createElement("pre");
      item.className = "tool-call";
      const fn = call.function || {};
      item.textContent = `${fn.name || "?"}(${fn.arguments || ""})`;
      return item;
    }));
  }

  function renderConversation() {
    el.log.replaceChildren(...state.conversation.messages.map(messageNode));
    el.empty.hidden = state.conversation.messages.length > 0;
  }

  function scrollToEnd(force) {
    const nearEnd = el.log.scrollHeight - el.log.scrollTop - el.log.clientHeight < 80;
    if (force || nearEnd) el.log.scrollTop = el.log.scrollHeight;
  }

  async function copyText(text, button) {
    let ok = false;
    try {
      await navigator.clipboard.writeText(text);
      ok = true;
    } catch (_) {
      ok = copyWithSelection(text);  // no clipboard API (plain http on a remote host)
    }
    button.textContent = ok ? "Copied" : "Copy failed";
    setTimeout(() => { button.textContent = "Copy"; }, 1500);
  }

  function copyWithSelection(text) {
    const area = document.createElement("textarea");
    area.value = text;
    area.setAttribute("readonly", "");
    area.style.position = "fixed";
    area.style.opacity = "0";
    document.body.append(area);
    area.select();
    let ok = false;
    try {
      ok = document.execCommand("copy");
    } catch (_) {
      ok = false;
    }
    area.remove();
    return ok;
  }

  function setStatus(text) {
    el.status.textContent = text;
  }

  function setBusy(busy) {
    el.send.disabled = busy;
    el.stop.disabled = !busy;
  }

  // ------------------------------------------------------------------------------ chat

  // An error by the message box (nothing was sent; the message stays there); "" hides it.
  function composerError(message) {
    el.composerError.textContent = message;
    el.composerError.hidden = !message;
  }

  // The prompt's count for the request about to go (see countTokens); null when Stop ended the wait.
  async function countForSend(body, signal) {
    try {
      return await countTokens(body, signal);
    } catch (err) {
      if (err.name === "AbortError") return null;
      return { ok: false, status: 0, error: `Could not reach the server: ${err.message}` };
    }
  }

  async function send(text) {
    if (state.controller || !text.trim()) return;
    readSettingsFromForm();
    const settings = state.conversation.settings;
    let extra;
    try {
      extra = parseExtra(settings.extra);
    } catch (err) {
      composerError(err.message);
      return;
    }
    composerError("");
    const body = requestBody(settings, extra, conversationMessages(settings, text));
    const controller = new AbortController();
    state.controller = controller;
    setBusy(true);
    setStatus("Counting the prompt's tokens…");
    const count = await countForSend(body, controller.signal);
    if (count === null || (count.ok && count.left < 1)) {
      state.controller = null;
      setBusy(false);
      if (count === null) {
        setStatus("Stopped.");
        return;
      }
      // The server would refuse it (context_length_exceeded): say so instead of sending.
      state.counted = count;
      renderContext();
      composerError(`The conversation no longer fits the model's context: with this message the prompt is ` +
        `${formatTokens(count.used)} tokens of the ${formatTokens(count.ctx)} it holds, which leaves none ` +
        "for the reply. Start a new chat (or shorten the system prompt).");
      setStatus("Not sent: the conversation no longer fits the context.");
      return;
    }
    const capped = count.ok ? capBudget(body, count.left) : null;
    el.prompt.value = "";
    const conversation = state.conversation;
    conversation.messages.push({ role: "user", content: text });
    const reply = { role: "assistant", content: "", pending: true, stats: null };
    conversation.messages.push(reply);
    saveConversation();
    renderConversation();
    scrollToEnd(true);
    const node = el.log.lastElementChild;

    setStatus("Generating…");
    const t0 = performance.now();
    let tFirst = null;
    let pieces = 0;
    let usage = null;
    let finish = null;
    let cmf = null;
    let lastSave = t0;
    // Text received but not yet in the page. Painting once per frame, not once per token: a
    // small model streams thousands of tokens a second, and each DOM write forces a layout.
    let unpainted = "";
    let paintScheduled = false;
    let finished = false;

    const liveStats = (now) => {
      const seconds = tFirst === null ? 0 : (now - tFirst) / 1000;
      reply.stats = {
        tokens: pieces, tps: seconds > 0 ? pieces / seconds : undefined,
        ttft_ms: tFirst === null ? undefined : tFirst - t0, capped: capped === null ? undefined : capped,
      };
    };
    const paint = () => {
      paintScheduled = false;
      if (unpainted) {
        node._text.appendData(unpainted);
        unpainted = "";
      }
      if (finished) return;  // the final stats are already shown
      liveStats(performance.now());
      updateMessageNode(node, reply);
      scrollToEnd(false);
    };

    try {
      // A count the server refused (a wrong key, an invalid field) is the answer the request would get.
      const response = count.ok ? await fetch("/v1/chat/completions", {
        method: "POST", headers: headers(true), body: JSON.stringify(body), signal: controller.signal,
      }) : null;
      if (!response || !response.ok) {
        reply.error = response ? await errorOf(response) : count.error;
        if ((response ? response.status : count.status) === 401) {
          localStorage.removeItem(STORE_KEY);
          askKey("The server refused the request: enter its API key, then send again.", loadModel);
        }
      } else {
        let done = false;
        for await (const data of sseData(response)) {
          if (data === "[DONE]") {
            done = true;
            break;
          }
          let event;
          try {
            event = JSON.parse(data);
          } catch (_) {
            throw new Error(`the server sent an unreadable event: ${data.slice(0, 100)}`);
          }
          if (event.error) {  // a failure after the stream started
            reply.error = describeError(null, event.error);
            break;
          }
          const choice = event.choices && event.choices[0];
          if (choice) {
            const piece = choice.delta && choice.delta.content;
            if (piece) {
              if (tFirst === null) tFirst = performance.now();
              pieces += 1;
              reply.content += piece;
              unpainted += piece;
              if (!paintScheduled) {
                paintScheduled = true;
                requestAnimationFrame(paint);
              }
            }
            const calls = choice.delta && choice.delta.tool_calls;
            if (calls) {
              reply.tool_calls = reply.tool_calls || [];
              for (const call of calls) {  // the first delta of a call names it; later ones add arguments
                const at = call.index || 0;
                const known = reply.tool_calls[at];
                const fn = call.function || {};
                if (known) known.function.arguments += fn.arguments || "";
                else reply.tool_calls[at] = {id: call.id, function: {name: fn.name, arguments: fn.arguments || ""}};
              }
              updateMessageNode(node, reply);
            }
            if (choice.finish_reason) finish = choice.finish_reason;
          }
          if (event.cmf) cmf = event.cmf;
          if (event.usage) usage = event.usage;
          const now = performance.now();
          if (now - lastSave > SAVE_EVERY_MS) {
            lastSave = now;
            saveConversation();
          }
        }
        if (!done && !reply.error) reply.error = "The stream ended before the reply was complete.";
      }
    } catch (err) {
      if (err.name === "AbortError") {
        finish = "stopped";
      } else {
        reply.error = `Could not reach the server: ${err.message}`;
      }
    } finally {
      const tEnd = performance.now();
      finished = true;
      paint();
      liveStats(tEnd);
      const stats = reply.stats;
      if (usage) {
        stats.tokens = usage.completion_tokens;
        stats.prompt = usage.prompt_tokens;
        const details = usage.prompt_tokens_details;
        if (details && typeof details.cached_tokens === "number") stats.cached = details.cached_tokens;
      }
      if (cmf && typeof cmf.generation_tps === "number" && cmf.generation_tps > 0) stats.tps = cmf.generation_tps;
      else if (tFirst !== null && tEnd > tFirst) stats.tps = stats.tokens / ((tEnd - tFirst) / 1000);
      stats.finish = finish || (reply.error ? "error" : undefined);
      if (cmf) {
        stats.task = cmf.task || undefined;
        stats.ran = ranText(cmf, settings.skill);
      }
      delete reply.pending;
      state.controller = null;
      setBusy(false);
      updateMessageNode(node, reply);
      saveConversation();
      setStatus(reply.error ? reply.error : finish === "stopped" ? "Stopped." : "Reply complete.");
      scrollToEnd(false);
      refreshContext();
    }
  }

  function stop() {
    if (state.controller) state.controller.abort();
  }

  el.form.addEventListener("submit", (event) => {
    event.preventDefault();
    send(el.prompt.value);
  });

  el.prompt.addEventListener("keydown", (event) => {
    // Enter sends; Shift+Enter is a newline; an IME composition's Enter confirms the composition.
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      el.form.requestSubmit();
    }
  });

  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape" && state.controller) {
      event.preventDefault();
      stop();
    }
  });

  el.stop.addEventListener("click", stop);

  el.newChat.addEventListener("click", () => {
    stop();
    state.conversation.messages = [];
    saveConversation();
    renderConversation();
    composerError("");
    refreshContext();
    setStatus("New chat.");
    el.prompt.focus();
  });

  el.panelToggle.addEventListener("click", () => {
    const open = !el.panel.classList.contains("open");
    el.panel.classList.toggle("open", open);
    el.layout.classList.toggle("panel-open", open);
    el.panelToggle.setAttribute("aria-expanded", String(open));
  });

  // ------------------------------------------------------------------------------ start

  applySettingsToForm();
  renderConversation();
  scrollToEnd(true);
  loadModel();
  el.prompt.focus();
})();
